import sys

from teraio.cli import main

sys.exit(main())
