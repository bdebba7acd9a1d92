import sys

from skippy_stage.cli.commands import main

sys.exit(main())
