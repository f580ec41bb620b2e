"""Copy stdin to stdout line by line, the API key (environment variable SFDSPARK_API_KEY)
replaced by `<api-key>`: a keyed server's output on its way to the log (api_key.py).
Run with `python -I`, outside the package (it imports nothing of ours)."""

import os
import sys


def main() -> None:
    key = os.environ.pop("SFDSPARK_API_KEY", "").encode()  # api_key.KEY_ENV
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        out.write(line.replace(key, b"<api-key>") if key else line)
        out.flush()


if __name__ == "__main__":
    main()
