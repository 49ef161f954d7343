"""The soak's bookkeeping around a supervised restart of tritonserver (dspark.perf.soak): errors
inside a restart window are reported as lost in it, not as unexpected; everything else stays
unexpected; RSS sampled while the processes are gone or reloading does not count as a leak."""

from dspark.perf.soak import RESTART_SETTLE_S, Stats, summarize


def test_errors_inside_a_restart_window_are_lost_in_it_and_the_others_stay_unexpected():
    st = Stats()
    st.count("stream_finished")
    st.count("unexpected", "error", "connection refused", t=10.0)
    st.count("unexpected", "error", "stream no longer valid", t=12.5)
    st.count("unexpected", "bad:wrong_error", "wrong", t=11.0)
    st.count("unexpected", "error", "late", t=30.0)
    st.count("bad_rejected", "bad:0", "top_p must be in")
    assert st.excuse([(9.0, 13.0)]) == 3
    assert st.outcomes == {"stream_finished": 1, "unexpected": 1, "lost_in_restart": 3, "bad_rejected": 1}
    assert st.errors == {"error": 1, "bad:0": 1}  # only the one after the window is left
    assert st.excuse([]) == 0 and st.outcomes["unexpected"] == 1
    assert st.excuse([(29.0, 31.0)]) == 1 and "unexpected" not in st.outcomes and "error" not in st.errors


def _samples(rss_by_t):
    return [{"t": t, "rss_mb": {"tritonserver": r}} for t, r in rss_by_t]


def test_rss_growth_ignores_samples_in_and_just_after_a_restart():
    # steady 1,000 MB; the server is down at 10-14 s (nothing running) and reloading until +RESTART_SETTLE_S
    rss = [(t, 1000.0) for t in range(12, 60, 3)]
    rss = [(t, 50.0 if 10 <= t <= 14 + RESTART_SETTLE_S else r) for t, r in rss]
    args = (1.0, 4, 15, 0.2, {"active": 0.0}, 0)
    seen = summarize(Stats(), _samples(rss), *args)
    assert seen["rss"]["growth"] > 1  # counted, the reload looks like a 20-fold leak
    res = summarize(Stats(), _samples(rss), *args, windows=[(10.0, 14.0)])
    assert res["rss"]["growth"] == 0.0
