"""PointNet (Qi et al. 2017) spatial transformer and classifier, plus a SimCLR-style projection head,
as written in the commonly used research re-implementations."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class STN3d(nn.Module):
    def __init__(self, channel=3):
        super(STN3d, self).__init__()
        self.conv1 = torch.nn.Conv1d(channel, 64, 1)
        self.conv2 = torch.nn.Conv1d(64, 128, 1)
        self.conv3 = torch.nn.Conv1d(128, 256, 1)
        self.fc1 = nn.Linear(256, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 9)
        self.relu = nn.ReLU()

        self.bn1 = nn.BatchNorm1d(64)
        self.bn2 = nn.BatchNorm1d(128)
        self.bn3 = nn.BatchNorm1d(256)
        self.bn4 = nn.BatchNorm1d(128)
        self.bn5 = nn.BatchNorm1d(64)

    def forward(self, x):
        batchsize = x.size()[0]
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, 256)

        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        x = self.fc3(x)

        iden = torch.eye(3, dtype=x.dtype, device=x.device).view(1, 9).repeat(batchsize, 1)
        x = x + iden
        x = x.view(-1, 3, 3)
        return x


class PointNetCls(nn.Module):
    def __init__(self, k=10, channel=3):
        super(PointNetCls, self).__init__()
        self.stn = STN3d(channel)
        self.conv1 = nn.Conv1d(channel, 64, 1)
        self.bn1 = nn.BatchNorm1d(64)
        self.conv2 = nn.Conv1d(64, 256, 1)
        self.bn2 = nn.BatchNorm1d(256)
        self.fc1 = nn.Linear(256, 128)
        self.bn3 = nn.BatchNorm1d(128)
        self.dropout = nn.Dropout(p=0.4)
        self.fc2 = nn.Linear(128, k)

    def forward(self, x):
        trans = self.stn(x)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.bn2(self.conv2(x))
        x = torch.max(x, 2, keepdim=True)[0]
        x = x.view(-1, 256)
        x = self.fc1(x)
        x = self.dropout(x)
        x = F.relu(self.bn3(x))
        x = self.fc2(x)
        x = F.log_softmax(x, dim=1)
        return x, trans


class ProjectionHead(nn.Module):
    """SimCLR / BYOL style non-linear projection head."""

    def __init__(self, in_dim=64, hidden_dim=128, out_dim=32):
        super().__init__()
        self.head = nn.Sequential(
            nn.Linear(in_dim, hidden_dim, bias=False),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim),
        )

    def forward(self, x):
        return self.head(x)


class SimCLRModel(nn.Module):
    def __init__(self, in_dim=16, feat_dim=64):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_dim, feat_dim), nn.ReLU())
        self.projector = ProjectionHead(feat_dim)

    def forward(self, x):
        h = self.encoder(x)
        return F.normalize(self.projector(h), dim=1)
