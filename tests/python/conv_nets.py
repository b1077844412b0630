"""The channels_last conv nets the strides tests train (torch_strides_test, torch_strides_ranks_test), their DMuon
hyper-parameters and the tolerance between two memory formats' runs."""

import torch

HYPER = dict(lr=0.02, momentum=0.9, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01,
             ns_dtype="float32")  # the tolerances are float32's, whatever the machine's default


class ConvNet(torch.nn.Module):
    """conv(3→8, 3×3) → ReLU → conv(8→8, 3×3, stride 2) → ReLU → mean over space → linear(8→4)."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):  # x (B, 3, H, W)
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


class PatchEmbedding(torch.nn.Module):
    """ViT's stem: conv(3→16, 4×4, stride 4) as the patch projection → (B, patches, 16) → one hidden
    linear → mean over patches → linear(16→4)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 16, 4, stride=4)
        self.mlp = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):  # x (B, 3, H, W)
        tokens = self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, 16)
        return self.head(torch.relu(self.mlp(tokens)).mean(dim=1))


# Both runs compute the same forward and backward in a different order (the convolutions' memory format), so
# their gradients differ by float32 rounding, ~1e-7 relative; Newton–Schulz maps it to about the same relative
# change of each update (lr 0.02: ~1e-9 absolute per step) and the weights, of size ~0.1–1, stay within 1e-5.
CONV_TOLERANCE = 1e-5
