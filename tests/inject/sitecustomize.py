"""Test-only start-up hook: the fault drills put tests/inject/ first on PYTHONPATH of the
runs they start (torchrun and its ranks inherit it), so Python imports this module at
start-up, before the trainer. It installs the faults the drill's variables ask for
(drills.py); with none set it does nothing. The product never reads these variables."""

import drills

drills.install()
