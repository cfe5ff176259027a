import io
import logging

from proxy import access_log


def test_the_access_log_writes_whatever_the_process_log_level() -> None:
    """`access_log: true` under `ferry serve --log-level WARNING` still writes its
    lines (they are INFO records of their own logger)."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    stream = io.StringIO()
    access_log.install_handler(stream)
    try:
        access_log.log.info('{"request_id": "r1"}')
    finally:
        root.setLevel(level)
        access_log.log.handlers.clear()
        access_log.log.setLevel(logging.NOTSET)
        access_log.log.propagate = True
    assert stream.getvalue() == '{"request_id": "r1"}\n'
