"""`llmft export` writes a model card the hub reads, and `--push-to-hub` stops cleanly offline
(tests/unit/test_modelcard.py has the card's contents)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT, metrics


def test_export_writes_a_card_the_hub_reads_and_push_stops_cleanly_offline(lora_run, tmp_path):
    from huggingface_hub import ModelCard

    out = tmp_path / "adapter"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "llmft", "export", str(lora_run), "--out", str(out), "--push-to-hub", "me/tiny-lora"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    # The export is complete; the push is a user error naming the repo and how to push later.
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"exported to {out}" in done.stdout
    assert "--push-to-hub me/tiny-lora: could not push" in done.stderr and "OfflineModeIsEnabled" in done.stderr
    assert f"hf upload me/tiny-lora {out}" in done.stderr
    assert "Traceback" not in done.stderr
    assert (out / "adapter_model.safetensors").is_file()

    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "peft" and data["pipeline_tag"] == "text-generation"
    assert {"llmft", "lora"} <= set(data["tags"])
    assert "base_model" not in data  # a model.config base is on no hub
    text = card.text
    state = json.loads((lora_run / "checkpoints/step-3/trainer_state.json").read_text())
    final = metrics(lora_run)[-1]
    final_eval = metrics(lora_run, "eval")[-1]
    assert "| method | LORA |" in text
    assert "| adapter | r 4, alpha 32.0, dropout 0.0, targets all-linear |" in text
    assert "| batch | micro 4 x accumulation 2 x data-parallel 1 = global 8 sequences of up to 64 tokens |" in text
    assert f"| target tokens trained | {state['tokens']:,} |" in text
    (source,) = state["data_sources"]  # what each training source held, recorded in the checkpoint
    assert source["records"] == 58 and source["tokens"] > source["target_tokens"] > 0  # 64 minus the 10 % eval holdout
    assert (
        f"| data | `{source['source']}`: 58 records, {source['tokens']:,} tokens "
        f"({source['target_tokens']:,} trained on) |" in text
    )
    assert "| optimizer steps | 3 |" in text
    assert f"- train loss {final['loss']:.4f} at step 3" in text
    assert f"loss {final_eval['loss']:.4g}" in text
    assert f"| torch | {state['versions']['torch']} |" in text
    assert "AutoPeftModelForCausalLM" in text
    assert "name: tiny-lora" in text  # the resolved recipe, to reproduce the run

    # the export path on the tracked MLflow run
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{lora_run.parent / 'mlruns'}")
    run_id = state["trackers"]["mlflow"]["run_id"]
    assert client.get_run(run_id).data.tags["llmft.export_path"] == str(out.resolve())
