"""Label conventions shared by preprocessing, packing, the loss, SP padding and evaluation."""

# The label of a token that is not trained on (prompt tokens, padding, each sample's last position after the
# shift). HF and torch's cross_entropy use the same value, so labels pass to either unchanged.
IGNORE_INDEX = -100
