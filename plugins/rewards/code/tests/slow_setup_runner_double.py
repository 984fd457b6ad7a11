"""Test double of the sandbox's runner: the real ``_runner.py`` after a 2-second stall, standing in for a setup
that the kernel keeps waiting (seen under load: seconds blocked in namespace and mount calls before the program's
first line). Only the first stage stalls: the real runner re-executes itself, not this file."""

import runpy
import sys
import time

time.sleep(2.0)
runpy.run_path(sys.argv.pop(1), run_name="__main__")
