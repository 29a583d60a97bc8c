"""`python -m ckpt_service.cli`."""

from ckpt_service.cli import main

main()
