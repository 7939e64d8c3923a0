from ear_jax import Memory
memory = Memory()  # frozen all-MiniLM-L6-v2 encoder + identity adapter; EAR defaults (K=20, T=4, batch 4)
memory.add(["Alice: I adopted a cat named Luna.", "Bob: I started learning the violin.", "Alice: Luna sleeps on my keyboard.",
            "Bob: My sister lives in Lisbon.", "Alice: I work as a nurse in Boston.", "Bob: I ran a marathon last spring."])
for question, gold in [("What is Alice's cat called?", {"m0"}), ("Where does Bob's sister live?", {"m3"})] * 2:
    for t in range(memory.config.num_rounds):  # a question's T Explorer rounds train as ONE query (Eq. 11-14)
        r = memory.retrieve(question if t == 0 else None, k=3, explore=True, continue_from=r if t else None)
        memory.feedback(r, [i for i in r.ids if i in gold])  # the ids your LLM cited; a step per 4 questions
memory.save("ear_memory_ckpt")  # atomic Orbax checkpoint: bank, embeddings, learner, config
memory = Memory.load("ear_memory_ckpt")
print(memory.retrieve("Who has a cat?", k=2).texts)
