"""hybridpipe's torchrun entry point: one process per worker of a plan.

    hybridpipe profile alexnet-small -b 32 -o profile.json
    hybridpipe partition profile.json --cluster examples/clusters/local4.json -o plan.json
    torchrun --standalone --nproc-per-node 4 launch.py --plan plan.json --steps 100

Across hosts: ``torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint
HOST:29500 launch.py --plan plan.json ...``. ``python launch.py --help`` lists the options.
"""

import sys

from hybridpipe.runtime.main import main

if __name__ == "__main__":
    sys.exit(main())
