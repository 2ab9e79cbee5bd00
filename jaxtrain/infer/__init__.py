"""Reading a trained model: decoding with a KV cache (`generate`), the choice of each next token
(`sampling`), scoring text (`scoring`) and loading a run or a Hugging Face directory (`loading`)."""
