try:
    import circleops_npu_ops  # noqa: F401
except ImportError as err:  # say how to get it, rather than a bare ImportError per test module
    raise ImportError("the example plugin is not installed: pip install -e examples/circleops-npu-ops "
                      "(.ci/run does)") from err
