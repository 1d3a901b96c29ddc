"""``python -m capskip_fx.train ...``"""
from .cli import main

main()
