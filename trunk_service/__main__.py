"""`python -m hydra_jury.trunk_service` (or `hydra-jury trunk`): serve the trunk and drafter heads.

    python -m hydra_jury.trunk_service --checkpoint DIR --listen 127.0.0.1:50051 \
        --drafter-heads head0,head1 --max-sessions 16 --max-session-tokens 4096
"""

import sys

from hydra_jury.serving.worker_service import service_main
from hydra_jury.trunk_service.server import TRUNK_SERVICE

sys.exit(service_main(TRUNK_SERVICE, prog="python -m hydra_jury.trunk_service"))
