"""Progress output when stderr is not a terminal: periodic plain lines with rates and an ETA."""

from __future__ import annotations

import io

from pipeline.preprocess.progress import Progress


def test_plain_progress_lines_have_rates_and_eta():
    stream = io.StringIO()
    progress = Progress(total_bytes=1000, stream=stream, log_interval=0.0)
    progress.update(documents=10, tokens=500, input_bytes=250, text_bytes=2000)
    progress.update(documents=10, tokens=500, input_bytes=250, text_bytes=2000)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[-1].startswith("[preprocess] 20 docs")
    for part in ("docs/s", "MB/s", "tok/s", "50%", "ETA"):
        assert part in lines[-1]
    assert "20 documents, 1,000 tokens" in progress.summary()


def test_quiet_progress_prints_nothing():
    stream = io.StringIO()
    progress = Progress(total_bytes=None, stream=stream, log_interval=0.0, enabled=False)
    progress.update(documents=1, tokens=1, input_bytes=1, text_bytes=1)
    assert stream.getvalue() == ""
