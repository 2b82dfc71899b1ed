"""``python -m rdrop_fairseq`` prints the directory to pass to fairseq's ``--user-dir``."""

import os

print(os.path.dirname(os.path.abspath(__file__)))
