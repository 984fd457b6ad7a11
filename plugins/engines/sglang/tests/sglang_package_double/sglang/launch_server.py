"""TEST DOUBLE of ``python -m sglang.launch_server`` (see ../README.md)."""

import sys

from sglang.srt.server_args import prepare_server_args

if __name__ == "__main__":
    from sglang.srt.entrypoints.http_server import launch_server

    launch_server(prepare_server_args(sys.argv[1:]))
