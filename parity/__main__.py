import sys

from parity import main

sys.exit(main())
