"""`python -m hydra_jury.kernels`: builds the native kernels now (`make setup`)."""

from hydra_jury.kernels.native import main

main()
