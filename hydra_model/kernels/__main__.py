"""`python -m hydra_jury.hydra_model.kernels`: builds the native kernels now (`make setup`)."""

from hydra_jury.hydra_model.kernels.native import main

main()
