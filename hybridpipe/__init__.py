"""hybridpipe: pipelined hybrid-parallel training for PyTorch.

The user's path is profile -> partition -> launch (see README.md). Packages import
one way: profiles -> partitioner -> comm -> pipeline -> runtime -> cli / launch.py.
"""

__version__ = "0.1.0"
