"""The seed's training transform, shared by the loader and training comparisons:
RandomResizedCrop(res) + RandomHorizontalFlip + ToTensor + Normalize (ImageNet mean/std)."""

from torchvision import transforms


def train_transform(res):
    return transforms.Compose([
        transforms.RandomResizedCrop(res),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
