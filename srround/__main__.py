import sys

from srround._cli import main

sys.exit(main())
