"""``python -m nemo_fp8_plugin.tools.gpu_check`` (what ``scripts/gpu_check.sh`` runs)."""

import sys

from . import main

sys.exit(main())
