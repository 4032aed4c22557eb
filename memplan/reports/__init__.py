"""memplan's HTML reports: self-contained pages of plotly figures, one module per page.

- ``page``: the page itself (``Page``, ``style_figure``, ``write_page``) and writing it safely
  (``check_report_path`` before the work, ``save_page`` after it);
- ``run``: a training run's report, from RUN/metrics.jsonl (``memplan train``, ``finetune``);
- ``validate``: predicted against measured memory (``memplan validate``, training and inference);
- ``sweep``: memory, speed and epoch time across a sweep (``memplan sweep --html``);
- ``step_time``: predicted against measured step time (``benchmarks/step_time.py``).

The commands and the benchmarks only call these; each figure is one function.
"""
