#!/usr/bin/env bash
# Run the multi-rank tests of tests/distributed N times in a row and say how many runs passed.
#
#   scripts/stress.sh N [-j JOBS] [-k EXPR] [TEST ...]
#
# TEST: pytest node ids (default: the DDP, FSDP2 and ZeRO-3 training and resume tests below).
# -k EXPR: only the selected tests whose names match EXPR (pytest -k).
# -j JOBS: pytest-xdist workers per run (default 0: one test at a time, no xdist; CI runs 2).
#
# Every run is a fresh pytest process: each torchrun launch gets a fresh rendezvous port
# (tests/helpers.py), PYTHONHASHSEED is the run's number; the tests' own seeds stay fixed (they
# compare losses with a reference run). A failed run keeps its log in $STRESS_LOGS (default: a
# temporary folder, printed).
# Prints one line per run (pass/FAIL, seconds) and "passed P of N" at the end; exits 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in '' | *[!0-9]*) usage ;; esac
runs=$1
shift
jobs=0
select=()
tests=()
while [ $# -gt 0 ]; do
    case "$1" in
    -j) jobs=$2; shift 2 ;;
    -k) select=(-k "$2"); shift 2 ;;
    -h | --help) usage ;;
    *) tests+=("$1"); shift ;;
    esac
done
if [ ${#tests[@]} -eq 0 ]; then
    tests=(
        "tests/distributed/test_training.py::test_adamw_20_steps_match_single_process[ddp]"
        "tests/distributed/test_training.py::test_adamw_20_steps_match_single_process[fsdp]"
        "tests/distributed/test_training.py::test_adamw_20_steps_match_single_process[zero3]"
        "tests/distributed/test_elastic.py::test_two_ranks_stopped_resume_on_two_ranks[ddp]"
        "tests/distributed/test_elastic.py::test_two_ranks_stopped_resume_on_two_ranks[fsdp]"
        "tests/distributed/test_elastic.py::test_two_ranks_stopped_resume_on_two_ranks[zero3]"
        "tests/distributed/test_preemption_ranks.py::test_torchrun_process_group_sigterm_then_resume_matches[ddp]"
        "tests/distributed/test_preemption_ranks.py::test_torchrun_process_group_sigterm_then_resume_matches[fsdp]"
    )
fi
logs=${STRESS_LOGS:-$(mktemp -d -t llmft-stress-XXXXXX)}
mkdir -p "$logs"
echo "stress: $runs run(s) of ${#tests[@]} test(s), $jobs pytest worker(s); logs of failed runs in $logs"
passed=0
for i in $(seq 1 "$runs"); do
    start=$(date +%s)
    log="$logs/run-$i.log"
    if PYTHONHASHSEED=$i python -m pytest -q -p no:cacheprovider -n "$jobs" \
        -m "slow or not slow" "${select[@]}" "${tests[@]}" >"$log" 2>&1; then
        passed=$((passed + 1))
        status=pass
        rm -f "$log"
    else
        status="FAIL (log: $log)"
    fi
    echo "run $i/$runs: $status, $(($(date +%s) - start)) s"
done
echo "passed $passed of $runs"
[ "$passed" -eq "$runs" ]
