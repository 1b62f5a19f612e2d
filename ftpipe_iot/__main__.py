"""``python -m ftpipe_iot`` runs the CLI (the demo starts its processes this way)."""

from ftpipe_iot.cli import main

main()
