import sys

from tracer.report.cli import standalone

sys.exit(standalone())
