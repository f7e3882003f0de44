import os
import sys

# The tests import helpers from this folder (_cases.py) and the package itself.
sys.path.insert(0, os.path.dirname(__file__))
