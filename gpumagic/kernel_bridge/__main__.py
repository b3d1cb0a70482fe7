"""``python -m gpumagic.kernel_bridge -f CONNECTION_FILE --host HOST``: the kernel process a
gpumagic kernelspec starts (:mod:`gpumagic.kernel_bridge.bridge`)."""

import sys

from .bridge import main

if __name__ == "__main__":
    sys.exit(main())
