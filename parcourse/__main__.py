import sys

from parcourse.cli import main

sys.exit(main())
