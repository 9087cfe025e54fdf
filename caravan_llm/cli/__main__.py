import sys

from caravan_llm.cli.main import main

sys.exit(main())
