from llmft.cli import main

raise SystemExit(main())
