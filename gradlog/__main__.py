import sys

from gradlog.cli import main

sys.exit(main())
