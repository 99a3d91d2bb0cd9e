import sys

from lightning_mgpu.cli.main import main

sys.exit(main())
