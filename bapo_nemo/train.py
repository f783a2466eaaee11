"""`python -m bapo_nemo.train --config CONFIG [overrides]`: BAPO on NeMo-RL, v0.7.0 or main
(bapo_nemo/nemo/driver.py)."""

import sys

from bapo_nemo.nemo.driver import main

if __name__ == "__main__":
    sys.exit(main())
