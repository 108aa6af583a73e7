import sys

from gradlog.cli.entry import main

sys.exit(main())
