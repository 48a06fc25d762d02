"""DSPOT thresholds: the alarm rate follows the risk, and few peaks widen the tail."""
import numpy as np

from fleetscope.streams.model.threshold import DSpot


def calibrated(x, **kw) -> DSpot:
    t = DSpot(risk=1e-3, level=0.9, depth=0, **kw)
    t.warm(x)
    t.calibrate()
    return t


def test_alarm_rate_on_fresh_scores_is_near_the_risk():
    rng = np.random.default_rng(0)
    t = calibrated(rng.exponential(1.0, 5000))
    fresh = rng.exponential(1.0, 200_000)
    rate = t.step(fresh, learn=False).mean()
    assert 2e-4 <= rate <= 5e-3                     # risk 1e-3; an exponential tail is what the GPD fits


def test_few_peaks_widen_the_tail_and_many_peaks_do_not():
    rng = np.random.default_rng(1)
    few = rng.exponential(1.0, 30)                   # 3 peaks at level 0.9
    plain, wide = calibrated(few), calibrated(few, tail_uncertainty=2.0)
    assert plain.u == wide.u
    assert (wide.z - wide.u) / (plain.z - plain.u) > 2.0   # 1 + 2 / sqrt(3)
    many = rng.exponential(1.0, 5000)                # 500 peaks
    plain, wide = calibrated(many), calibrated(many, tail_uncertainty=2.0)
    assert 1.05 < (wide.z - wide.u) / (plain.z - plain.u) < 1.15   # 1 + 2 / sqrt(500)


def test_a_short_warm_up_alarms_at_the_nominal_risk_with_the_default_widening():
    """45 warm-up scores (15 windows x 3 ranks, the evaluation's setting), then 300 healthy
    scores, over 200 independent jobs: plain DSPOT alarms at about 4x its risk (its scale
    comes from 4-5 peaks); the default widening (ModelConfig.tail_uncertainty) brings the
    rate back to about the risk."""
    from fleetscope.streams.model import ModelConfig
    risk, rates = 5e-4, {0.0: [], ModelConfig().tail_uncertainty: []}
    for seed in range(200):
        rng = np.random.default_rng(seed)
        warm, stream = rng.normal(0, 1, 45), rng.normal(0, 1, 300)
        for u in rates:
            t = DSpot(risk=risk, level=0.9, depth=200, tail_uncertainty=u)
            t.warm(warm)
            t.calibrate()
            rates[u].append(t.step(stream).mean())
    plain, widened = np.mean(rates[0.0]), np.mean(rates[ModelConfig().tail_uncertainty])
    assert plain > 2.5 * risk
    assert 0.5 * risk <= widened <= 1.5 * risk


def test_one_window_where_every_rank_jumped_does_not_lift_a_warm_up_that_trends():
    """The shape a dev job_wide_slowdown run calibrated on (3 ranks, 10 windows): scores falling from 4 to -4 as
    the mixture learns, and one window where every rank scored 26. Capped around the median, the trend's spread
    let the jump through and the threshold was ~170, above the fault's scores (~30); around the trend it is not."""
    falling = np.linspace(4.4, -3.8, 30) + np.tile([0.1, -0.1, 0.0], 10)
    jumped = falling.copy()
    jumped[18:21] = 26.0

    def threshold(scores, detrend):
        t = DSpot(risk=5e-4, level=0.9, depth=200, tail_uncertainty=1.0, warm_detrend=detrend)
        t.warm(scores)
        t.calibrate()
        return t.threshold()

    assert threshold(jumped, detrend=False) > 100                  # the failure, as measured
    assert threshold(jumped, detrend=True) < 30
    # a clean warm-up calibrates as before, and a fault's scores still alarm
    assert threshold(falling, True) < 10 and threshold(falling, False) < 10
    t = DSpot(risk=5e-4, level=0.9, depth=200, tail_uncertainty=1.0)
    t.warm(jumped)
    t.calibrate()
    assert t.step(np.array([40.0, -4.0])).tolist() == [True, False]
