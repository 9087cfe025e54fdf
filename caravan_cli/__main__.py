import sys

from caravan_cli.main import main

sys.exit(main())
