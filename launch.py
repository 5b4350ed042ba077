"""Run ``hybridpipe.launch`` from a checkout: ``torchrun ... launch.py --plan plan.json`` (see hybridpipe/launch.py)."""
from hybridpipe.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
