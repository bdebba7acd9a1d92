import sys

from skippy_stage.cli import main

sys.exit(main())
