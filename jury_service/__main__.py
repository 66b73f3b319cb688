"""`python -m hydra_jury.jury_service` (or `hydra-jury jury`): serve some heads of a checkpoint as
one jury shard.

    python -m hydra_jury.jury_service --checkpoint DIR --listen 127.0.0.1:50061 --heads head0,head1
"""

import sys

from hydra_jury.jury_service.server import JURY_SERVICE
from hydra_jury.serving.worker_service import service_main

sys.exit(service_main(JURY_SERVICE, prog="python -m hydra_jury.jury_service"))
