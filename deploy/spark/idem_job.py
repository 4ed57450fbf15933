"""spark-submit entry point: runs ``idem run`` inside the submitted Spark driver.

    spark-submit [spark options] deploy/spark/idem_job.py [idem run arguments]

Everything after the script name goes to ``idem run`` unchanged; settings come
from the ``IDEM_*`` environment variables (deploy/env.example). Your own PySpark
application that uses idem's decorators is submitted the same way, in place of
this file (``APP=my_app.py deploy/spark/spark-submit.sh``).
"""

from __future__ import annotations

import sys

from idem.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
