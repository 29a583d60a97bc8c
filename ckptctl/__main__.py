"""`python -m ckptctl`."""

from ckptctl import main

main()
