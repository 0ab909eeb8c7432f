"""The models: CNNs (:mod:`.cnn`), the GPT (:mod:`.gpt`), its mixture of experts (:mod:`.moe`) and the torch-free model names."""
