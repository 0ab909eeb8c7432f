"""labkit.models.cnn: shapes, the paper's parameter counts, and flat Sequential == module (forward and backward)."""
import pytest
import torch
from torch import nn

from labkit.errors import ConfigError
from labkit.models import cnn as models

SIZES = [(1, 28), (3, 32)]  # MNIST-like, CIFAR-like


pytestmark = pytest.mark.usefixtures("one_thread")


def test_registry_names():
    assert list(models.MODELS) == ["mlp", "lenet", "resnet8", "resnet20", "resnet32", "resnet50", "alexnet_small"]


@pytest.mark.parametrize("name, depth", [("resnet8", 8), ("resnet20", 20), ("resnet32", 32)])
def test_cifar_resnets_have_6n_plus_2_weight_layers(name, depth):
    model = models.get_model(name, in_channels=3, image_size=32)
    weighted = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(weighted) == depth  # He et al. 2016: 6n + 2 layers, identity (zero-padded) shortcuts


def _randomise(model: nn.Module) -> None:
    """Non-trivial parameters and BatchNorm statistics, so every layer matters in the comparison."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn_like(m.running_mean) * 0.1)
                m.running_var.copy_(torch.rand_like(m.running_var) + 0.5)


# resnet50 only at its hands-on size (1x28x28): it is the slow one
CASES = [(name, c, s) for name in models.MODELS for c, s in SIZES if name != "resnet50" or c == 1]


@pytest.mark.parametrize("name, in_channels, image_size", CASES)
def test_sequential_computes_the_same_function(name, in_channels, image_size):
    torch.manual_seed(0)
    model = models.get_model(name, num_classes=7, in_channels=in_channels, image_size=image_size)
    _randomise(model)
    seq = models.to_sequential(model)
    assert isinstance(seq, nn.Sequential)
    assert [p.data_ptr() for p in seq.parameters()] == [p.data_ptr() for p in model.parameters()]  # same order
    assert any(isinstance(layer, nn.Flatten) for layer in seq)
    x = torch.randn(2, in_channels, image_size, image_size)

    model.eval()
    seq.eval()
    with torch.no_grad():
        expected = model(x)
        assert expected.shape == (2, 7) and torch.isfinite(expected).all() and expected.std() > 0
        # seq(x), one entry at a time (what nn.Sequential's forward does): the flat model cut at every boundary,
        # each entry mapping one tensor to one tensor
        h = x
        for layer in seq:
            h = layer(h)
        torch.testing.assert_close(h, expected, rtol=0, atol=0)

    model.train()  # BatchNorm on batch statistics; same gradients through both forms
    grads = []
    for net in (model, seq):
        net.zero_grad()
        net(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g_model, g_seq in zip(*grads):
        torch.testing.assert_close(g_seq, g_model, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", [n for n in models.MODELS if n != "resnet50"])
def test_get_model_sequential_matches_a_seeded_build(name):
    torch.manual_seed(0)
    model = models.get_model(name, in_channels=3, image_size=32)
    torch.manual_seed(0)
    seq = models.get_model(name, in_channels=3, image_size=32, sequential=True)
    assert isinstance(seq, nn.Sequential) and not isinstance(model, nn.Sequential)
    for p_model, p_seq in zip(model.state_dict().values(), seq.state_dict().values(), strict=True):
        assert torch.equal(p_model, p_seq)
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    seq.eval()
    with torch.no_grad():
        torch.testing.assert_close(seq(x), model(x), rtol=0, atol=0)


def test_cifar_resnet_parameter_counts_match_the_paper():
    # He et al. 2016, Table 6: ResNet-20 0.27 M, ResNet-32 0.46 M parameters (option A shortcuts: none)
    assert models.count_parameters(models.get_model("resnet32", in_channels=3, image_size=32)) == 464_154
    assert models.count_parameters(models.get_model("resnet20", in_channels=3, image_size=32)) == 269_722
    net = models.get_model("resnet20", in_channels=3, image_size=32)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) + 1 == 20  # 6n + 2 weighted layers with n = 3: 19 convs and the linear layer
    assert [net.layer1[0].conv1.out_channels, net.layer2[0].conv1.out_channels, net.layer3[0].conv1.out_channels] \
        == [16, 32, 64]


def test_seed_networks_have_the_slide_shapes():
    mlp = models.get_model("mlp")
    assert [(m.in_features, m.out_features) for m in mlp.modules() if isinstance(m, nn.Linear)] == \
        [(784, 512), (512, 512), (512, 10)]
    assert isinstance(list(models.to_sequential(mlp))[-1], nn.Linear)  # logits are not clipped by a ReLU
    lenet28, lenet32 = models.get_model("lenet"), models.get_model("lenet", in_channels=3, image_size=32)
    assert (lenet28.fc1.in_features, lenet32.fc1.in_features) == (16 * 4 * 4, 16 * 5 * 5)
    assert models.count_parameters(lenet32) == 62_006  # LeNet-5 of the slides: 3 input channels, 10 classes


def test_alexnet_small_layers_follow_the_seed_000_strategy():
    net = models.get_model("alexnet_small", in_channels=3, image_size=32)
    assert isinstance(net.features, nn.Sequential) and isinstance(net.classifier, nn.Sequential)
    names = [n for n, _ in models.to_sequential(net).named_children() if not n.startswith("relu")]
    assert names == ["conv1", "pool2", "conv3", "pool4", "conv5", "conv6", "conv7", "pool8", "flat",
                     "linear9", "linear10", "linear11"]
    assert sum(isinstance(m, nn.Conv2d) for m in net.features) == 5
    assert sum(isinstance(m, nn.MaxPool2d) for m in net.features) == 3
    assert sum(isinstance(m, nn.Linear) for m in net.classifier) == 3
    # the linear layers hold most parameters, the convolutions most of the compute
    assert models.count_parameters(net.classifier) > models.count_parameters(net.features)
    # He init keeps the signal through 8 layers without BatchNorm (PyTorch's default init: logit std ~0.02);
    # the last layer at a tenth of that scale starts the logits small, the loss near ln 10
    torch.manual_seed(0)
    with torch.no_grad():
        x = torch.randn(16, 3, 32, 32)
        assert net.classifier[:-1](net.flat(net.features(x))).std() > 1.0
        assert 0.1 < net(x).std() < 1.5


def test_resnet50_is_torchvision_with_a_small_image_stem():
    import torchvision

    net = models.get_model("resnet50")
    assert isinstance(net, torchvision.models.ResNet)
    assert (net.conv1.in_channels, net.conv1.kernel_size, net.conv1.stride) == (1, (3, 3), (1, 1))
    seq = models.to_sequential(net)
    names = [n for n, _ in seq.named_children()]
    assert names[:4] == ["conv1", "bn1", "relu", "maxpool"] and names[-3:] == ["avgpool", "flatten", "fc"]
    assert len(names) == 4 + (3 + 4 + 6 + 3) + 3  # one entry per bottleneck block
    net.eval()
    with torch.no_grad():
        assert seq[:-3](torch.randn(1, 1, 28, 28)).shape == (1, 2048, 2, 2)  # stages at 14, 7, 4, 2 pixels


def test_bad_model_requests_raise_config_error():
    with pytest.raises(ConfigError, match=r"unknown model 'vgg16'; choose one of: mlp, lenet, resnet8, resnet20, resnet32"):
        models.get_model("vgg16")
    with pytest.raises(ConfigError, match="lenet needs image_size >= 16, got 8"):
        models.get_model("lenet", image_size=8)
    with pytest.raises(ConfigError, match="mlp needs num_classes >= 1, got 0"):
        models.get_model("mlp", num_classes=0)
    with pytest.raises(ConfigError, match="Bilinear has no flat form"):
        models.to_sequential(nn.Bilinear(2, 2, 2))
