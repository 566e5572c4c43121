"""python -m indexer_q: the indexer-q command line."""
from indexer_q.cli import main

raise SystemExit(main())
