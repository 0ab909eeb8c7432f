"""labkit.parallel.memory, the one memory model, by hand: a block's activations under tp, sp, selective and full
recompute, bf16; a run's terms and the moment of its peak. (Measured against MemTracker in notebook 12; the
activations to the byte against saved tensors in tests/test_cp.py, tests/test_megatron.py and test_recompute.py.)"""
from labkit.models.gpt import GPTConfig
from labkit.parallel.memory import layer_activation_bytes, predict_memory

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)


def test_one_block_under_tp_sp_and_recompute():
    # b = 2, s = 8, h = 16, a = 4, t = 2: sbh = 256, sb = 16
    assert layer_activation_bytes(2, 8, 16, 4, tp=2) == 4 * (256 * (4 + 6) + 64 + 32) == 10624
    assert layer_activation_bytes(2, 8, 16, 4, tp=2, sp=True) == 4 * (256 * (2 + 7) + 32 + 32) == 9472
    assert layer_activation_bytes(2, 8, 16, 4, tp=2, sp=True, recompute="selective") == 9472 - 4 * 32 == 9344
    assert layer_activation_bytes(2, 8, 16, 4, tp=2, sp=True, recompute="selective", ring=True) == 9472
    assert layer_activation_bytes(2, 8, 16, 4, tp=2, sp=True, recompute="full") == 4 * 256 / 2 == 512
    assert layer_activation_bytes(2, 8, 16, 4, tp=2, recompute="full") == 1024
    assert layer_activation_bytes(2, 8, 16, 4, tp=2, sp=True, e=2) == 4736  # bf16: half the fp32 bytes


def test_a_run_s_terms_and_its_peak():
    # P = 2·(12·16² + 13·16) + (32 + 8)·16 = 7200 parameters; fp32 Adam: W = G = 28800, O = 57600
    one = predict_memory(CFG, 2)
    assert (one["parameters"], one["gradients"], one["optimizer"]) == (28800, 28800, 57600)
    # per block 4·(16·256 + 64 + 64) = 16896; the head 4·16·(32 + 2 + 32) = 4224, ids 256, positions 64, loss 4
    assert one["layer"] == 16896 and one["activations"] == 2 * 16896 + 4224 + 256 + 64 + 4 == 38340
    # backward start: W + O + A + the loss's 2·4·16·32 = 4096; backward end: W + O + G = 115200
    assert one["phases"] == {"backward start": 128836, "backward end": 115200}
    assert one["peak"] == sum(one["at_peak"].values()) == 128836 and one["moment"] == "backward start"
    # full: each block keeps its input (4·256 = 1024); in the last block's backward one block rebuilt (16896) and
    # the head's and a block's gradients made, 28800·(32·16 + 12·256 + 13·16)/7200 = 15168
    full = predict_memory(CFG, 2, recompute="full")
    assert full["activations"] == 2 * 1024 + 4548 == 6596
    assert full["phases"] == {"backward start": 97092, "backward end": 115200, "last block's backward": 125060}
    assert full["peak"] == 125060 and full["moment"] == "last block's backward"
    # ZeRO-2 over dp = 2: gradients and Adam's state halved, the parameters whole
    z2 = predict_memory(CFG, 2, dp=2, zero=2, recompute=True)
    assert (z2["parameters"], z2["gradients"], z2["optimizer"]) == (28800, 14400, 28800)
    assert z2["phases"]["last block's backward"] == 28800 + 28800 + 7584 + 6596 + 16896 == z2["peak"] == 88676


def test_pipeline_stages_and_context_parallel_ranks():
    # pp = 2: a stage's 1 block + the embeddings, 3280 + 40·16 = 3920 parameters (W = G = 15680, O = 31360); 1F1B's
    # first stage holds 2 micro-batches in flight of its 1 block: 2·16896 + the head 4548 = 38340
    pp = predict_memory(CFG, 2, pp=2, in_flight=2)
    assert (pp["parameters"], pp["optimizer"], pp["activations"]) == (15680, 31360, 38340)
    assert pp["peak"] == 15680 + 31360 + 38340 + 4096 == 89476
    # cp = 2: 4 tokens a rank; ring attention keeps its log-sum-exp: 4·(4·2·16·16 + 4·8 + 4·8) = 8448 per block;
    # the head 4·8·66 + 16·8 + 8·4 + 4 = 2276; the weights whole, so the end of backward is the peak
    cp = predict_memory(CFG, 2, cp=2)
    assert (cp["layer"], cp["activations"]) == (8448, 2 * 8448 + 2276)
    assert cp["moment"] == "backward end" and cp["peak"] == 28800 + 57600 + 28800
