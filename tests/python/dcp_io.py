"""A model's and its DMuon's state saved to a folder and loaded back with torch.distributed.checkpoint (get_state_dict
+ dcp.save; dcp.load + set_state_dict), as the DCP tests do it (torch_dcp_test, torch_owner_held_dcp_test,
torch_muon_options_ranks_test)."""

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save(model, opt, folder):
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)


def load(model, opt, folder):
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
