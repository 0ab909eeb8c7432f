"""Pipeline schedules as data (labkit.parallel.pp_schedule) and their simulator (labkit.parallel.pp_simulate), pure:
literal action lists, the simulator's counted idle time equal to each generator's docstring formula (written out
here, not computed by the kit), the peaks of activations in flight, the messages per step, each rule's error, and
the order of every rank's F/B/W equal to ``torch.distributed.pipelining``'s schedule of the same name (its action
lists built from stand-in stages, no process group)."""
import types
from fractions import Fraction

import pytest
import torch

from labkit.errors import ConfigError
from labkit.parallel.pp_schedule import Action, PipeSchedule, pipe_schedule
from labkit.parallel.pp_simulate import PipelineScheduleError, simulate

COSTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (3, 2, 1), (2, 2, 1), (1, 1, Fraction(1, 2))]


def test_literal_action_lists():
    s = pipe_schedule("zb-h1", 4, 8)
    assert s.describe(0) == ("F0.0 F0.1 F0.2 F0.3 B0.0 W0.0 F0.4 B0.1 W0.1 F0.5 B0.2 W0.2 F0.6 B0.3 W0.3 F0.7 "
                             "B0.4 W0.4 B0.5 W0.5 B0.6 W0.6 B0.7 W0.7")
    assert s.describe(3) == ("F3.0 B3.0 F3.1 B3.1 F3.2 B3.2 F3.3 B3.3 W3.0 F3.4 B3.4 W3.1 F3.5 B3.5 W3.2 F3.6 "
                             "B3.6 W3.3 F3.7 B3.7 W3.4 W3.5 W3.6 W3.7")
    assert pipe_schedule("1f1b", 2, 3).describe(0) == "F0.0 F0.1 BW0.0 F0.2 BW0.1 BW0.2"
    assert pipe_schedule("gpipe", 2, 2).describe(1) == "F1.0 F1.1 BW1.0 BW1.1"
    inter = pipe_schedule("interleaved-1f1b", 2, 2, 2)
    assert inter.describe(0) == "F0.0 F0.1 F2.0 F2.1 BW2.0 BW2.1 BW0.0 BW0.1"  # warm-up 2 + 2 = every forward
    assert inter.describe(1) == "F1.0 F1.1 F3.0 BW3.0 F3.1 BW3.1 BW1.0 BW1.1"
    assert inter.stages_of(0) == [0, 2] and inter.stages_of(1) == [1, 3]
    v = pipe_schedule("zbv", 2, 3)
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2] and v.rank_of(2) == 1
    assert v.describe(1) == "F1.0 F2.0 F1.1 F2.1 B2.0 W2.0 F1.2 B1.0 W1.0 F2.2 B2.1 W2.1 B1.1 B2.2 B1.2 W1.1 W2.2 W1.2"


def test_simulated_step_of_1f1b_and_zb_h1():
    one = simulate(pipe_schedule("1f1b", 4, 8))
    assert (one.makespan, one.idle, one.peak, one.bubble) == (33, [9] * 4, [4, 3, 2, 1], Fraction(9, 33))
    zb = simulate(pipe_schedule("zb-h1", 4, 8))
    assert (zb.makespan, zb.idle, zb.peak) == (27, [3] * 4, [4, 4, 4, 4])
    assert [(str(a), t0, t1) for a, t0, t1 in zb.spans[3][:3]] == [("F3.0", 3, 4), ("B3.0", 4, 5), ("F3.1", 5, 6)]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("t_f, t_b, t_w", COSTS)
def test_counted_idle_time_equals_the_formula(p, t_f, t_b, t_w):
    """Idle time of every rank = makespan − its work, counted by the simulator, against each docstring's formula."""
    for m in (2 * p, 3 * p):
        expected = {
            ("gpipe", 1): (p - 1) * (t_f + t_b + t_w),
            ("1f1b", 1): (p - 1) * (t_f + t_b + t_w),
            ("interleaved-1f1b", 2): Fraction((p - 1) * (t_f + t_b + t_w)) / 2,
            ("interleaved-1f1b", 3): Fraction((p - 1) * (t_f + t_b + t_w)) / 3,
            ("zb-h1", 1): (p - 1) * (t_f + t_b - t_w),
        }
        if t_f == t_b == t_w:
            expected[("zbv", 2)] = Fraction((p - 1) * t_f) / 2
            expected[("dualpipev", 2)] = Fraction((p - 1) * t_f) / 2
        for (name, v), idle in expected.items():
            result = simulate(pipe_schedule(name, p, m, v), t_f, t_b, t_w)
            assert result.idle == [idle] * p, (name, p, m, v)
            assert result.makespan == m * (t_f + t_b + t_w) + idle


@pytest.mark.parametrize("p", [2, 3, 4])
def test_peak_activations_in_flight(p):
    m = 3 * p
    assert simulate(pipe_schedule("gpipe", p, m)).peak == [m] * p
    assert simulate(pipe_schedule("1f1b", p, m)).peak == [p - r for r in range(p)]
    assert simulate(pipe_schedule("zb-h1", p, m)).peak == [p] * p
    assert simulate(pipe_schedule("interleaved-1f1b", p, m, 2)).peak == [p + 2 * (p - 1 - r) + 1 for r in range(p)]
    assert simulate(pipe_schedule("zbv", p, m)).peak == [2 * p] * p       # chunks of half a stage: p stages' worth
    assert simulate(pipe_schedule("dualpipev", p, m)).peak == [2 * p + 1] * p


def test_messages_per_step():
    """Each activation and gradient that crosses ranks, counted from the data: 2 (S − 1) m less the V's turn."""
    assert pipe_schedule("1f1b", 4, 8).messages() == 2 * 3 * 8 == 48
    assert pipe_schedule("interleaved-1f1b", 4, 8, 2).messages() == 2 * 7 * 8 == 112
    assert pipe_schedule("zbv", 4, 8).messages() == 2 * 6 * 8 == 96   # stage 3 -> 4 stays on rank 3
    comms = pipe_schedule("1f1b", 2, 2).with_comms(1)
    assert comms[:4] == [("recv", ("act", 1, 0, 0)), ("compute", Action("F", 1, 0)), ("compute", Action("BW", 1, 0)),
                         ("send", ("grad", 0, 0, 0))]


def _schedule(lists, p=2, m=2, name="mine"):
    return PipeSchedule(name, p, m, 1, "loop", tuple(tuple(Action(*a) for a in acts) for acts in lists))


@pytest.mark.parametrize("lists, message", [
    ([[("F", 0, 0), ("F", 0, 1), ("W", 0, 0), ("B", 0, 0), ("B", 0, 1), ("W", 0, 1)],
      [("F", 1, 0), ("B", 1, 0), ("W", 1, 0), ("F", 1, 1), ("B", 1, 1), ("W", 1, 1)]],
     "rank 0, action 3 W0.0: W before its B"),
    ([[("F", 0, 0), ("F", 0, 1), ("BW", 0, 0), ("BW", 0, 1)], [("F", 0, 0)]], "stage 0 lives on rank 0, not on rank 1"),
    ([[("F", 0, 0), ("F", 0, 1), ("BW", 0, 0), ("BW", 0, 1)],
      [("F", 1, 0), ("BW", 1, 0), ("F", 1, 1), ("B", 1, 1)]], "W1.1 is missing"),
    ([[("F", 0, 0), ("F", 0, 1), ("BW", 0, 0), ("BW", 0, 1)],
      [("F", 1, 1), ("BW", 1, 1), ("BW", 1, 0)]], "backward before its forward F1.0"),
])
def test_each_broken_rule_is_named(lists, message):
    with pytest.raises(PipelineScheduleError, match=message.replace(".", r"\.")):
        simulate(_schedule(lists))


def test_the_deadlock_names_every_waiting_rank():
    """Rank 1 wants micro-batch 1 first; rank 0 sends it only after micro-batch 0's gradient, which rank 1 sends only
    after micro-batch 1: a cycle, every rank waiting on a receive whose send never comes."""
    lists = [[("F", 0, 0), ("BW", 0, 0), ("F", 0, 1), ("BW", 0, 1)],
             [("F", 1, 1), ("F", 1, 0), ("BW", 1, 0), ("BW", 1, 1)]]
    with pytest.raises(PipelineScheduleError) as info:
        simulate(_schedule(lists))
    assert str(info.value) == ("deadlock: rank 0 at BW0.0 (action 2) waits for the gradient from stage 1; "
                               "rank 1 at F1.1 (action 1) waits for F0.1")


@pytest.mark.parametrize("args, message", [
    (("zb-h1", 4, 3, 1), "--pp-schedule zb-h1 needs --num-microbatches >= 4 with pp=4, got 3"),
    (("dualpipev", 4, 7, 2), "--pp-schedule dualpipev needs --num-microbatches >= 8 with pp=4, got 7"),
    (("zbv", 4, 8, 1), "--pp-schedule zbv runs two chunks per rank, in a V: use --pp-virtual 2, not 1"),
    (("interleaved-1f1b", 4, 8, 1), "needs --pp-virtual >= 2"),
    (("zb-h1", 4, 8, 2), "--pp-schedule zb-h1 runs one stage per rank: use --pp-virtual 1, not 2"),
    (("nope", 4, 8, 1), "--pp-schedule 'nope': choose one of gpipe, 1f1b"),
])
def test_what_a_schedule_cannot_run_is_refused(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pipe_schedule(*args)


KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def _torch_order(cls, p, m, v, placement):
    """Every rank's compute actions of torch's schedule ``cls``, in labkit's spelling (``I`` is labkit's ``B``, torch's
    full backward ``B`` is ``BW``, an overlapped F;B pair its two actions in order), empty slots dropped."""
    n, order = p * v, {}
    for rank in range(p):
        index = [rank, n - 1 - rank] if placement == "v" else [c * p + rank for c in range(v)]
        stages = [types.SimpleNamespace(group_size=p, group_rank=rank, num_stages=n, stage_index=i, is_first=i == 0,
                                        is_last=i == n - 1, submod=torch.nn.Linear(1, 1)) for i in index]
        single = v == 1 and cls.__name__ in ("ScheduleGPipe", "Schedule1F1B")
        schedule = cls(stages[0] if single else stages, m)
        actions = schedule._get_pipeline_order()[rank] if single else schedule.pipeline_order[rank]
        order[rank] = [f"{KIND[b.computation_type.value]}{b.stage_index}.{b.microbatch_index}"
                       for a in actions if a is not None for b in (a.sub_actions or (a,))
                       if b.computation_type.value in KIND]
    return order


@pytest.mark.parametrize("name, torch_name, v", [
    ("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2), ("interleaved-1f1b", "ScheduleInterleaved1F1B", 3),
    ("zb-h1", "ScheduleInterleavedZeroBubble", 1), ("zbv", "ScheduleZBVZeroBubble", 2),
    ("dualpipev", "ScheduleDualPipeV", 2)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 12)])
def test_every_rank_runs_torch_pipelinings_order(name, torch_name, v, p, m):
    from torch.distributed.pipelining import schedules

    mine = pipe_schedule(name, p, m, v)
    theirs = _torch_order(getattr(schedules, torch_name), p, m, v, mine.placement)
    for r in range(p):
        ours = [str(a) for a in mine.actions[r]]
        if name == "1f1b" and r == p - 1:
            # torch's Schedule1F1B prints its last rank's forwards one micro-batch late (F3.1 .. F3.8 for m = 8: a
            # micro-batch that does not exist), while its runner runs F0 first; the order is ours with that shift
            assert theirs[r] == [a if not a.startswith("F") else f"F{r}.{int(a.split('.')[1]) + 1}" for a in ours]
            continue
        assert theirs[r] == ours, (name, r)


def test_the_advisor_prices_each_schedule_from_its_simulation():
    """The mesh price of TINY (2 blocks) on pp=2, m=4 (compute 7.2 s, test_advisor_mesh's plan by hand): the bubble is
    the simulated idle time, 1F1B's (p − 1)/m of the compute, ZB-H1's a third of it, GPipe's the same as 1F1B's but
    holding all m micro-batches; the activations held are the simulated peak. By hand (labkit.parallel.memory, 2
    bytes an element, micro-batches of b = 1 sequence of s = 4 tokens, h = 4, a = 2, V = 8, one block a stage): a
    block keeps s·b·h·(4 + 12) + 4·s·b + a·s·b = 280 elements = 560 bytes per micro-batch in flight, the head and
    the ids 2·b·s·(2h + 2 + V) + 16·b·s + 8·s + 4 = 244 bytes once: 1F1B and ZB-H1 hold p = 2 micro-batches,
    2·560 + 244 = 1364; GPipe all m = 4, 4·560 + 244 = 2484."""
    from labkit.advisor.plan import MeshPlan
    from labkit.advisor.topology import Topology
    from labkit.collectives.cost import CostModel
    from labkit.parallel.pricing import GPTShape, price_mesh

    tiny = GPTShape(n_layer=2, n_head=2, n_embd=4, vocab_size=8, seq=4, name="tiny")
    topo = Topology("test", 2, CostModel(0.01, 1e-3), float("inf"), "cuda", 1, 1, None, True, 1.0, 1e4)
    price = {s: price_mesh(MeshPlan(1, 1, 2, 1, microbatches=4, schedule=s), tiny, topo, 4)
             for s in ("gpipe", "1f1b", "zb-h1")}
    assert [price[s].time["bubble"] for s in ("gpipe", "1f1b", "zb-h1")] == pytest.approx([1.8, 1.8, 0.6])
    assert [price[s].memory["activations"] for s in ("gpipe", "1f1b", "zb-h1")] == [2484, 1364, 1364]
    assert MeshPlan(1, 1, 2, 1, microbatches=4, schedule="zb-h1").label == "pp=2 m=4 zb-h1"


ZB_H1 = '''\
def zb_h1_actions(p, m):
    actions = []
    for r in range(p):
        warm = min(p - r, m)
        acts = [("F", r, j) for j in range(warm)]
        for j in range(m):
            acts.append(("B", r, j))
            if j >= r:
                acts.append(("W", r, j - r))
            if warm + j < m:
                acts.append(("F", r, warm + j))
        acts += [("W", r, j) for j in range(m - r, m)]
        actions.append(acts)
    return actions
'''


def _answer(tmp_path, text, name="mine.py"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_pp_schedule_exercise(tmp_path, capsys):
    from labkit.exercises.cli import run_check

    assert run_check("pp-schedule", [_answer(tmp_path, ZB_H1)]) == 0
    assert "correct: valid" in capsys.readouterr().out
    starter = tmp_path / "starter.py"
    assert run_check("pp-schedule", ["--init", str(starter)]) == 0
    capsys.readouterr()
    assert run_check("pp-schedule", [str(starter)]) == 1
    assert capsys.readouterr().out.strip() == (
        "not yet: zb_h1_actions(2, 4) (t_F, t_B, t_W = 1, 1, 1): rank 0 idles 2; ZB-H1 idles (p − 1)(t_F + t_B − t_W) "
        "= 1: each W runs right after its B, where nobody waits for it; hold it back: rank r runs the W of "
        "micro-batch j − r after the B of micro-batch j, the rest at the end")
    early = ZB_H1.replace('acts.append(("W", r, j - r))', 'acts.append(("W", r, j + 1 - r))').replace(
        "range(m - r, m)", "range(m - r + 1, m)")
    assert run_check("pp-schedule", [_answer(tmp_path, early, "early.py")]) == 1
    assert "not yet: zb_h1_actions(2, 4): rank 0, action 4 W0.1: W before its B (B0.1 must come earlier in rank 0's " \
           "list)" in capsys.readouterr().out
    # rank 0 runs B0 before F1, rank 1 wants F1 before F0: each waits for the other
    crossed = ZB_H1.replace("warm = min(p - r, m)", "warm = 1 if r == 0 else min(p - r + 1, m)").replace(
        'acts = [("F", r, j) for j in range(warm)]', 'acts = [("F", r, j) for j in range(warm)][::-1]')
    assert run_check("pp-schedule", [_answer(tmp_path, crossed, "crossed.py")]) == 1
    assert capsys.readouterr().out.strip() == (
        "not yet: zb_h1_actions(2, 4): deadlock: rank 0 at B0.0 (action 2) waits for the gradient from stage 1; "
        "rank 1 at F1.1 (action 1) waits for F0.1")


def test_the_animation_has_one_frame_per_time_unit_of_the_simulated_step():
    import matplotlib

    matplotlib.use("Agg")
    from labkit.viz.pipeline import animate_schedule

    for name, frames in (("zb-h1", 27), ("1f1b", 33)):  # the simulated makespans at t_F = t_B = t_W = 1
        animation = animate_schedule(name, 4, 8)
        assert len(list(animation.new_frame_seq())) == frames
        animation._draw_frame(frames)
        matplotlib.pyplot.close("all")


def test_the_pipeline_preset_is_priced_from_the_named_schedule():
    """``price_pipeline`` (--strategy pipeline) with --pp-schedule: the bubble and each rank's activations in flight
    come from that schedule's simulation. Two equal stages (two layers of the same cost, m = 4): GPipe idles one
    slot tau, ZB-H1 (p − 1)(t_F + t_B − t_W) = tau / 3 with thirds of the slot; GPipe keeps 4 micro-batches on a
    rank, ZB-H1 p = 2."""
    from labkit.advisor.plan import LayerProfile, Plan, Profile
    from labkit.advisor.search import price
    from labkit.advisor.topology import Topology
    from labkit.collectives.cost import CostModel

    layers = [LayerProfile(f"l{i}", "Linear", (0.0, 0.001), (0.0, 0.002), 400, 0, 10) for i in range(2)]
    prof = Profile("two", "synthetic-mnist", 1, (2, 8), layers, 16, update_s_per_byte=0.0, data_s_per_sample=0.0,
                   base_bytes=0, feature_layers=2, tp_pairs=[], tp_hidden=[])
    topo = Topology("test", 2, CostModel(0.0, 0.0, 0.0), float("inf"), "cpu", cores=2)  # free messages
    options = (("num_microbatches", 4), ("balance", (1, 1)))
    gpipe = price(Plan("pipeline", 2, 2, 8, options), prof, topo)
    zb = price(Plan("pipeline", 2, 2, 8, options + (("pp_schedule", "zb-h1"),)), prof, topo)
    tau = 0.003 * 2  # one micro-batch of 2 samples: forward + backward of one layer
    assert gpipe.time["bubble"] == pytest.approx(tau) and zb.time["bubble"] == pytest.approx(tau / 3)
    assert gpipe.memory["activations"] == pytest.approx(4 * 2 * 10) and zb.memory["activations"] == pytest.approx(
        2 * 2 * 10)
