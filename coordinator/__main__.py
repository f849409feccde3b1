"""``python -m coordinator`` and the ``coordinator`` command. A Ctrl-C while the
command's modules load ends it as one a moment later would: ``interrupted``, 130."""

import sys


def run() -> int:
    try:
        from .cli import main
    except KeyboardInterrupt:
        sys.stderr.write("coordinator: interrupted\n")
        return 130
    return main()


if __name__ == "__main__":
    sys.exit(run())
