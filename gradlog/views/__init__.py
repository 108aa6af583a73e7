"""Views of a run read back from disk: the health analysis behind `gradlog report`, and plots.

Never imported by the training-loop path (`gradlog.run.logger`, `measure`, `verdict`, `writers`).
"""
