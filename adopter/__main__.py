import sys

from adopter.cli import main

sys.exit(main())
